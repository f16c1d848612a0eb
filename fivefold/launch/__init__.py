"""Starting processes: this node's workers through torch's elastic agent, and what they report.

- agent.py          `fivefold train --nproc/--nnodes`: the agent, the rendezvous, the forkserver
- elastic.py        the layout for the world a rendezvous round admits (re-plan on shrink or grow)
- worker_report.py  how each worker ended, so the launcher names the culprit
- run_lock.py       one job per run directory
- forkserver_guard.py  the forkserver ends with its launcher
"""
