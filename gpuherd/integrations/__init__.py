"""Callbacks for training frameworks: they tell gpuherd the framework's steps and checkpoints.

Under `gpuherd run`, the script bootstrap sees a script's optimizer steps and its `torch.save`
calls with no code in the script, but not what a framework means by them: its step count (which
goes on across a resume) or the path of a checkpoint it writes through a buffer (Lightning).
A framework callback says both:

  gpuherd.integrations.lightning.GpuherdCallback      PyTorch Lightning (`lightning` or `pytorch_lightning`)
  gpuherd.integrations.transformers.GpuherdCallback   `transformers.Trainer`

Each reports through gpuherd/status_channel.py (`step`, `phase`, `script_save` records) and
then speaks for the script: the bootstrap's own step counts stop. Outside gpuherd (no status
fd) it does nothing. It does not recover ranks live: docs/guide/torchrun.md says what each
can and cannot do.
"""
