"""The configuration: what a run is, read from TOML and the command line, before any process starts.

- schema.py     the frozen dataclasses, one per TOML table ([model] and its parts come from
                fivefold/model/config.py); TABLES and FIELD_TYPES, the schema walked by path
- load.py       TOML files, `--table.key=value` overrides, presets, to_toml, replace
- moved.py      the keys of earlier versions and where they are now
- types.py      whether a value is of its field's declared type
- derive.py     Derived: the numbers a layout derives (degrees, micro-batches, vocabulary), pure
- deepspeed.py  a DeepSpeed JSON config as fivefold overrides
"""
