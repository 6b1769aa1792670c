"""What a torchrun user brings: torchrun's flags, and a script in place of the built-in trainer.

  add_torchrun_flags, translate, TorchrunLaunch (flags.py): torchrun's flags -> gpuherd's settings
  apply_pet_defaults (pet.py): torchrun's PET_<FLAG> variables as the flags' defaults
  parse_rdzv_conf (rdzv_conf.py): --rdzv-conf key=value,...
  FileTimer, file_timer_wanted, timer_fifo (file_timer.py): TORCHELASTIC_ENABLE_FILE_TIMER=1's server
    (file_timer_main.py, a process of its own: it imports torch)
  numa_plan, bound (numa_binding.py): --numa-binding applied to each GPU worker (numactl or CPU affinity)
  write_launcher_error_file (launcher_error_file.py): the root cause into the launcher's TORCHELASTIC_ERROR_FILE
  Script, ScriptError (script.py): the user's program and the command line each rank runs
    (through worker/script_bootstrap.py: heartbeats from optimizer steps, no code in the script)
  ScriptSaves (script_saves.py): the script's saves gpuherd saw, and the words every line about them uses
"""

from supervisor.torchrun.flags import (
    DEFAULT_SIGNALS,
    NO_EFFECT,
    PET,
    TORCHRUN_FLAGS,
    TorchrunLaunch,
    add_torchrun_flags,
    translate,
)
from supervisor.torchrun.file_timer import FileTimer, file_timer_wanted, timer_fifo
from supervisor.torchrun.launcher_error_file import write_launcher_error_file
from supervisor.torchrun.numa_binding import bound, numa_plan
from supervisor.torchrun.pet import apply_pet_defaults
from supervisor.torchrun.script import BOOTSTRAP, Script, ScriptError
from supervisor.torchrun.script_saves import ScriptSaves

__all__ = ["BOOTSTRAP", "DEFAULT_SIGNALS", "NO_EFFECT", "PET", "TORCHRUN_FLAGS", "FileTimer", "Script", "ScriptError", "ScriptSaves",
           "TorchrunLaunch", "add_torchrun_flags", "apply_pet_defaults", "bound", "file_timer_wanted", "numa_plan", "timer_fifo", "translate",
           "write_launcher_error_file"]
