"""Hardware by name or by file: a catalog entry (datasheet.py) or a profile TOML.

A profile is the `Hardware` fields in a [hardware] table, with a [sources] table saying where each
comes from; `base = "h100"` starts from a catalog entry and overrides some fields. `fivefold
calibrate --out` writes one for the machine it ran on, with the measured compute costs too (the
keys of calibration.profile.MeasuredProfile, in the same table): a profile that has any of them
loads as a Hardware whose pricer prices with them (calibration.pricer.MeasuredPricer); one that
has none is priced from its figures like a catalog GPU. The training loop reads `run.hardware`
through load_profile and hands the result to selfcheck.predict_for_config.

The catalog's names are re-exported here, the import path the rest of fivefold has always used.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

from fivefold.planner.calibration.pricer import MeasuredPricer
from fivefold.planner.calibration.profile import MEASURED_FIELDS, MeasuredProfile
from fivefold.planner.machine.datasheet import ALIASES, ASSUMED, CATALOG, GB, TERA, Hardware, get_hardware

__all__ = ["ALIASES", "CATALOG", "GB", "TERA", "Hardware", "get_hardware", "load_profile", "profile_toml"]

_CORE_FIELDS = tuple(f.name for f in dataclasses.fields(Hardware) if f.name not in ("name", "sources", "pricer"))
_FIELDS = [*_CORE_FIELDS, *MEASURED_FIELDS]
# absent on a hand-written GPU profile: without the roofline's fields it is priced flat (datasheet.py);
# the host figures only offload needs
_ROOFLINE = ("sm_count", "matmul_tiles", "matmul_efficiency", "fp8_peak_flops", "fp8_matmul_efficiency",
             "attention_fwd_curve", "attention_bwd_curve", "fa2_fwd_curve", "fa2_bwd_curve", "hbm_efficiency")
_OPTIONAL = {*ASSUMED, "collective_alpha", *_ROOFLINE, "host_bw", "host_memory_bytes", *MEASURED_FIELDS}
_CURVES = ("matmul_curve", "elementwise_curve", "noise_curve", "attention_fwd_curve", "attention_bwd_curve",
           "fa2_fwd_curve", "fa2_bwd_curve")
_BY_OP = ("collective_alpha",)  # [[op, value], ...]
_INTS = ("gpus_per_node", "threads", "sm_count")


def load_profile(path: str | Path) -> Hardware:
    """A hardware profile written by `fivefold calibrate` (or by hand): [hardware] + [sources]."""
    data = tomllib.loads(Path(path).read_text())
    hw = dict(data.get("hardware", {}))
    base = hw.pop("base", "")  # a profile may start from a catalog entry and override some fields
    unknown = sorted(set(hw) - set(_FIELDS) - {"name"})
    if unknown:
        raise ValueError(f"{path}: unknown hardware keys {unknown}; valid: {_FIELDS}")
    sources = dict(data.get("sources", {}))
    for k in _CURVES:
        if k in hw:
            hw[k] = tuple((float(x), float(y)) for x, y in hw[k])
    for k in _BY_OP:
        if k in hw:
            hw[k] = tuple((str(op), float(y)) for op, y in hw[k])
    if "matmul_tiles" in hw:
        hw["matmul_tiles"] = tuple((int(a), int(b)) for a, b in hw["matmul_tiles"])
    if "layer_times" in hw:
        hw["layer_times"] = tuple((str(k), float(f), float(b)) for k, f, b in hw["layer_times"])
    measured = {k: hw.pop(k) for k in MEASURED_FIELDS if k in hw}
    priced = {"pricer": MeasuredPricer(MeasuredProfile(**measured))} if measured else {}
    if base:
        start = get_hardware(base)
        return dataclasses.replace(start, **hw, **priced, sources={**start.sources, **sources})
    missing = [f for f in _FIELDS if f not in hw and f not in _OPTIONAL]
    if missing:
        raise ValueError(f"{path}: missing hardware keys {missing} (or set base = 'h100' to start from the catalog)")
    return Hardware(**{"name": Path(path).stem, **hw, **priced, "sources": sources})


def _toml_line(key: str, value: object) -> str:
    if key in _CURVES:
        return f"{key} = [{', '.join(f'[{float(x)!r}, {float(y)!r}]' for x, y in value)}]"
    if key == "matmul_tiles":
        return f"{key} = [{', '.join(f'[{int(a)}, {int(b)}]' for a, b in value)}]"
    if key in _BY_OP:
        pairs = ", ".join(f'["{op}", {float(y)!r}]' for op, y in value)
        return f"{key} = [{pairs}]"
    if key == "layer_times":  # one part a line: the keys are long
        rows = "".join(f'\n  ["{k}", {float(fw)!r}, {float(bw)!r}],' for k, fw, bw in value)
        return f"{key} = [{rows}\n]" if value else f"{key} = []"
    return f"{key} = {int(value) if key in _INTS else float(value)!r}"


def profile_toml(hw: Hardware) -> str:
    """`hw` as a profile TOML that load_profile() reads back unchanged (the measured keys only when
    its pricer is a measured profile's)."""
    values = {f: getattr(hw, f) for f in _CORE_FIELDS}
    if isinstance(hw.pricer, MeasuredPricer):
        values |= {f: getattr(hw.pricer.profile, f) for f in MEASURED_FIELDS}
    lines = ["[hardware]", f'name = "{hw.name}"']
    lines += [_toml_line(f, values[f]) for f in _FIELDS if f in values]  # the figures, then what was measured
    lines += ["", "[sources]"]
    for k, v in sorted(hw.sources.items()):
        lines.append(f'{k} = "{v.replace(chr(34), chr(39))}"')
    return "\n".join(lines) + "\n"
