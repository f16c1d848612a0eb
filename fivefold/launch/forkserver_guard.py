"""Preloaded by the launcher's forkserver (launch/agent.py): the forkserver ends with the launcher.

The forkserver forks the workers and outlives a SIGKILLed launcher (the pipes it watches stay open
in other processes), keeping the rendezvous socket it inherited. Importing this module there asks
the kernel to end it when the launcher dies (launch.die_with_parent); each worker does the same
with the forkserver, so nothing of a killed job stays behind. An import anywhere else (a process
whose parent is not the launcher named in the environment) does nothing.
"""

import os

from fivefold.launch.agent import LAUNCHER_PID, die_with_parent

if os.environ.get(LAUNCHER_PID) == str(os.getppid()):
    die_with_parent()
