"""What a torchrun user brings: torchrun's flags, and a script in place of the built-in trainer.

  add_torchrun_flags, translate, TorchrunLaunch (flags.py): torchrun's flags -> gpuherd's settings
  Script, ScriptError (script.py): the user's program and the command line each rank runs
    (through worker/script_bootstrap.py: heartbeats from optimizer steps, no code in the script)
"""

from supervisor.torchrun.flags import TorchrunLaunch, add_torchrun_flags, translate
from supervisor.torchrun.script import BOOTSTRAP, Script, ScriptError

__all__ = ["BOOTSTRAP", "Script", "ScriptError", "TorchrunLaunch", "add_torchrun_flags", "translate"]
