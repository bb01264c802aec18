"""The conventions every `strata` command line follows, as vLLM's and llama.cpp's users expect:

- every flag's help shows its default (`StrataHelpFormatter`);
- a mistyped flag is answered with "did you mean --x?" from the command's own flags;
- `-v` and `--log-level` work after the subcommand as well as before it (`add_logging_flags`);
- `--config FILE.yaml` (keys = long flag names, with `-` or `_`, as `vllm serve --config`) and
  `STRATA_<FLAG>` environment variables, on the commands that opt in (`enable_config`,
  `enable_env`). Precedence: flag > environment > file > default. Both are applied as the
  command's argparse defaults before the real parse, so the command line always wins and the
  code reading `args` cannot tell where a value came from. Unknown keys are refused with a close
  match; values are converted and checked as argparse would check them on the command line.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from pathlib import Path
from typing import Any

from strata.errors import ConfigError

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
# the config file's own flag and --help take no value from a file; --config may come from the environment
_NOT_FROM_FILE = ("--config", "--help")


class StrataHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Epilogs kept as written; "(default: X)" appended to every option whose help does not say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or action.default is argparse.SUPPRESS or "%(default)" in text
                or "(default" in text or "default:" in text):
            return text
        return f"{text} (default: {_describe_default(action)})".strip()


def _describe_default(action: argparse.Action) -> str:
    if action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction):
        return "off"  # a switch: the default is not giving it
    d = action.default
    if d is None:
        return "none"
    if isinstance(d, bool):
        return "on" if d else "off"
    return str(d).replace("%", "%%")


class StrataParser(argparse.ArgumentParser):
    """ArgumentParser with the conventions above; sub-commands inherit the class (add_subparsers)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("formatter_class", argparse.HelpFormatter) in (
                argparse.HelpFormatter, argparse.RawDescriptionHelpFormatter):
            kwargs["formatter_class"] = StrataHelpFormatter
        super().__init__(*args, **kwargs)
        self.config_file = False  # takes --config FILE.yaml
        self.env_prefix: str | None = None  # reads <prefix><FLAG> environment variables

    def error(self, message: str):
        """One line (argparse would print the whole usage block first), exit 2 as argparse does."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):  # noqa: D102 (argparse's signature)
        argv = list(sys.argv[1:] if args is None else args)
        ns, extras = self.parse_known_args(argv, argparse.Namespace(**vars(namespace or argparse.Namespace())))
        leaf = leaf_parser(self, ns)
        if isinstance(leaf, StrataParser) and (leaf.config_file or leaf.env_prefix):
            try:
                layered = leaf.layered_defaults(getattr(ns, "config", None) if leaf.config_file else None)
            except ConfigError as e:
                leaf.error(str(e))
            if layered:
                leaf.set_defaults(**layered)
                ns, extras = self.parse_known_args(argv, namespace)
        if extras:
            leaf.error(unrecognized_message(leaf, extras))
        return ns

    # --- config file and environment ------------------------------------------------------------
    def layered_defaults(self, config_path: str | None) -> dict[str, Any]:
        """dest -> value from the YAML file, then the environment over it (flags come later)."""
        values: dict[str, Any] = {}
        options = self.long_options()
        if self.env_prefix and config_path is None and "--config" in options:
            config_path = os.environ.get(env_name(self.env_prefix, "--config")) or None
        if config_path is not None:
            for key, value in read_config_file(config_path).items():
                option = _option_for_key(key, options, config_path)
                values.update(_dest_value(options[option], value, f"{config_path}: {key}"))
        if self.env_prefix:
            for option, action in options.items():
                if option in _NOT_FROM_FILE:
                    continue
                name = env_name(self.env_prefix, option)
                raw = os.environ.get(name)
                if raw:  # an empty variable counts as unset, as shells use it
                    values.update(_dest_value(action, raw, name, from_env=True))
        return values

    def long_options(self) -> dict[str, argparse.Action]:
        """'--flag' -> its action, for every option of this parser (short-only ones as '-x')."""
        out = {}
        for action in self._actions:
            names = [o for o in action.option_strings if o.startswith("--")] or action.option_strings[:1]
            for o in names:
                out[o] = action
        return out


def env_name(prefix: str, option: str) -> str:
    """'--max-num-seqs' -> 'STRATA_MAX_NUM_SEQS'."""
    return prefix + option.lstrip("-").upper().replace("-", "_")


def read_config_file(path: str) -> dict[str, Any]:
    import yaml

    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read ({e.strerror or e})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML ({' '.join(str(e).split())})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag names to values, got {type(data).__name__}")
    return data


def _option_for_key(key: Any, options: dict[str, argparse.Action], source: str) -> str:
    name = str(key).strip().lstrip("-").replace("_", "-")
    for option in ("--" + name, "-" + name):
        if option in options and option not in _NOT_FROM_FILE:
            return option
    keys = [o.lstrip("-") for o in options if o not in _NOT_FROM_FILE]
    close = difflib.get_close_matches(name, keys, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else "; keys are the command's long flag names"
    raise ConfigError(f"--config {source}: unknown key {key!r}{hint}")


def _dest_value(action: argparse.Action, value: Any, source: str, from_env: bool = False) -> dict[str, Any]:
    """{dest: value} as the command line would have set it, or {} for a switch turned off."""
    if isinstance(action, argparse.BooleanOptionalAction):
        return {action.dest: _as_bool(value, source)}
    if action.nargs == 0:  # store_true / store_const / count: a switch
        if isinstance(action, argparse._CountAction):
            on = _as_bool(value, source)
            return {action.dest: 1} if on else {}
        return {action.dest: action.const} if _as_bool(value, source) else {}
    many = isinstance(action, argparse._AppendAction) or action.nargs in ("+", "*")
    if many:
        items = value.split() if from_env and action.nargs in ("+", "*") else value
        items = items if isinstance(items, list) else [items]
        return {action.dest: [_one(action, v, source) for v in items]}
    if isinstance(value, list | dict):
        raise ConfigError(f"{source}: expected one value, got {type(value).__name__}")
    return {action.dest: _one(action, value, source)}


def _as_bool(value: Any, source: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigError(f"{source}: expected true or false, got {value!r}")


def _one(action: argparse.Action, value: Any, source: str) -> Any:
    if isinstance(value, bool) or isinstance(value, list | dict):
        raise ConfigError(f"{source}: expected a value for {action.option_strings[-1]}, got {value!r}")
    convert = action.type
    if convert is int and isinstance(value, float) and not value.is_integer():
        raise ConfigError(f"{source}: expected an integer, got {value!r}")
    try:
        if convert in (int, float):
            out = convert(value)
        else:
            out = convert(str(value)) if callable(convert) else str(value)
    except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
        raise ConfigError(f"{source}: invalid value {value!r} ({e})") from None
    if action.choices is not None and out not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise ConfigError(f"{source}: invalid choice {value!r} (choose from {choices})")
    return out


# --- parse errors and the tree ---------------------------------------------------------------------
def leaf_parser(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub-)command parser the arguments selected."""
    while True:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        name = getattr(ns, sub.dest, None) if sub is not None else None
        if sub is None or name not in sub.choices:
            return parser
        parser = sub.choices[name]


def unrecognized_message(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """'unrecognized argument --temprature; did you mean --temperature?' (difflib, this command's flags)."""
    options = sorted({o for a in parser._actions for o in a.option_strings if o.startswith("--")})
    for token in extras:
        if token.startswith("--"):
            name = token.split("=", 1)[0]
            close = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else ""
            return f"unrecognized argument {name}{hint}"
    return f"unrecognized arguments: {' '.join(extras)}"


def walk_leaves(parser: argparse.ArgumentParser):
    """Every (sub-)command parser that has no sub-commands of its own."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield parser
    for sub in subs:
        for child in dict.fromkeys(sub.choices.values()):  # aliases map to the same parser
            yield from walk_leaves(child)


def add_logging_flags(parser: argparse.ArgumentParser, top: bool = False, default_level: str = "warning") -> None:
    """-v / --log-level; on sub-commands they default to SUPPRESS so the top-level value survives."""
    have = {o for a in parser._actions for o in a.option_strings}
    g = parser.add_argument_group("logging")
    default = {} if top else {"default": argparse.SUPPRESS}
    if "-v" not in have and "--verbose" not in have:
        g.add_argument("-v", "--verbose", action="store_true", help="log at INFO: the memory plan, what dtype "
                       "auto picked and why, load time (same as --log-level info) (default: off)", **default)
    if "--log-level" not in have:
        g.add_argument("--log-level", choices=LOG_LEVELS, type=str.lower, metavar="LEVEL",
                       help=f"{' | '.join(LOG_LEVELS)}; overrides -v (default: {default_level}"
                       + (", or info with -v)" if default_level == "warning" else ")"), **default)


def enable_config(parser: StrataParser) -> None:
    """--config FILE.yaml on this command."""
    parser.config_file = True
    parser.add_argument("--config", default=None, metavar="FILE.yaml",
                        help="YAML file of flag values: keys are the long flag names (max-num-seqs or "
                        "max_num_seqs); flags given on the command line override it (default: none)")


def enable_env(parser: StrataParser, prefix: str = "STRATA_") -> None:
    """<prefix><FLAG> environment variables for every flag of this command."""
    parser.env_prefix = prefix


def log_level(args: argparse.Namespace, default: str = "warning") -> str:
    """--log-level if given, else info with -v, else `default` (a server logs at info, as vLLM's)."""
    given = getattr(args, "log_level", None)
    return given or ("info" if getattr(args, "verbose", False) else default)
