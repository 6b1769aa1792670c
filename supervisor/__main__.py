"""`python -m supervisor` (what run_training.sh execs)."""

from gpuherd.extras import extras_named

with extras_named("python -m supervisor"):
    from supervisor.main import cli

    cli()
