"""Thin command-line entry points (`python -m pipelines.<name>`); the work is in `transforms/` and `dspark/`."""

import logging


class _WithoutGcpClientsWarning(logging.Filter):
    """Beam warns at import when its optional Google Cloud clients are missing. Local runs never
    use them, and a Dataflow launch installs them (`pip install -e ".[dataflow]"`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "apitools not found" not in record.getMessage()


logging.getLogger().addFilter(_WithoutGcpClientsWarning())


def run_main(main) -> int:
    """Run an entry point's `main()`. What the user can fix ends in one `error:` line and exit
    status 2 instead of a traceback: a missing file (named, or left at its default) and a
    refused value (a bad method, drafter or scheduler name, a prompt file without prompts: the
    library raises ValueError for these). DSPARK_TRACEBACK=1 shows the traceback instead."""
    import os
    import sys

    try:
        return main() or 0
    except (FileNotFoundError, ValueError) as exc:
        if os.environ.get("DSPARK_TRACEBACK"):
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2
