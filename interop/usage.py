"""Command-line usage mistakes in one line, for the CLI and the trainers alike."""

from __future__ import annotations

import argparse

EXIT_USAGE = 2  # argparse's own code for a usage mistake; the CLI's for input it cannot use


class OneLineParser(argparse.ArgumentParser):
    """Usage mistakes in one line (exit 2), pointing at ``--help`` instead of printing the whole usage."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
