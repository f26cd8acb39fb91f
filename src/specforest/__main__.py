"""``python -m specforest`` and the ``specforest`` command.

The command line needs the ``cli`` extra (click, matplotlib); without it this
says what to install instead of failing with a traceback.
"""

from __future__ import annotations

import sys

_CLI_PACKAGES = ("click", "matplotlib")


def main() -> None:
    """Run the ``specforest`` command line."""
    try:
        from .cli import main as cli_main
    except ImportError as e:
        missing = getattr(e, "name", None)
        if missing and missing.split(".")[0] in _CLI_PACKAGES:
            sys.exit(
                f"specforest: the command line needs {missing.split('.')[0]}, which is not installed; "
                "pip install 'specforest[cli]' (or 'specforest[all]' for every command)"
            )
        raise
    cli_main()


if __name__ == "__main__":
    main()
