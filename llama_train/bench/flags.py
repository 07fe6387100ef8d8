"""The benchmark scripts' flags, declared from their settings dataclass: a flag's type and default
are the field's, so each default is written once."""

import argparse


def add_flags(parser: argparse.ArgumentParser, defaults, helps: dict[str, str]):
    """`--NAME` for each NAME in `helps`, typed and defaulted as `defaults.NAME`; `{}` in a help text
    stands for the default."""
    for name, text in helps.items():
        default = getattr(defaults, name)
        parser.add_argument(f"--{name}", type=type(default), default=default, help=text.format(default))
