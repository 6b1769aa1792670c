"""`python -m supervisor` (what run_training.sh execs)."""

from supervisor.main import main

raise SystemExit(main())
