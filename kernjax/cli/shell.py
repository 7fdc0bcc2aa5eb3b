"""The shell every verb runs under: absl flags defined per verb, user errors as one paragraph.

A user error (bad flag value, a refused cut, a checkpoint that does not fit) ends with a
one-paragraph message and exit status 2, never a traceback; Ctrl-C ends with `interrupted` and
status 130 (SIGTERM: `terminated`, 143). `--help` lists the flags the verb defines.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import sys
import textwrap
import threading
import time

from absl import app, flags, logging

FLAGS = flags.FLAGS


HELP = {"--help", "-help", "--helpshort", "-helpshort", "-h", "-?"}


def run(main_def) -> None:
    """Defines a command's flags and runs it under absl. `--help` lists the flags the command
    defined and exits 0; a user error is a message and status 2; Ctrl-C is one line and 130."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # also where a shell started us with SIGINT ignored
        signal.signal(sig, _stop)
    try:
        # the objects, held: a command may override absl's own flag, and the freed object's id
        # could come back as a new flag's (serve's --log_file went missing from --help so)
        before = {id(f): f for f in (FLAGS[n] for n in FLAGS)}
        main = main_def()
        args = sys.argv[1:]
        if HELP & set(args[:args.index("--")] if "--" in args else args):
            own = {FLAGS[n] for n in FLAGS if id(FLAGS[n]) not in before}
            # the verb's own usage; never __main__'s docstring, which is kernjax/__main__.py's
            print(usage(main_def.__doc__ or f"Usage: {sys.argv[0]} [--flags]",
                        sorted(own, key=lambda f: f.name)))
            sys.exit(0)

        def wrapped(argv):
            logging.set_verbosity(logging.WARNING)
            extra = argv[1:]
            takes, verbs = getattr(main, "takes_args", False), getattr(main, "verbs", [])
            if not takes and extra != verbs[:1]:
                if not verbs:
                    fail(f"unexpected arguments {extra}; every option is a --flag (see --help)")
                fail((f"unexpected arguments {extra}; the verb is {verbs[0]}" if extra else
                      f"`{sys.argv[0]}` needs its verb, {verbs[0]}") +
                     f": run `{_with_verb(verbs[0], args, extra)}`")
            try:  # kernjax's own errors (CutError, StageError, ...) are ValueError or RuntimeError
                return main(extra) if takes else main()
            except (ValueError, RuntimeError, OSError) as e:
                fail(str(e))
            except MemoryError as e:  # states sized past the host's memory, say
                fail(f"out of memory: {e}; lower --pages, --seqs or --context")

        app.run(wrapped, flags_parser=_parse)
    except KeyboardInterrupt as e:
        _exit_now(str(e))


def _with_verb(verb: str, args: list[str], extra: list[str]) -> str:
    """The command line the user meant: the verb, then their own flags without the stray
    `extra` words."""
    args = list(args)
    for word in reversed(extra):  # a stray word follows the flags; a flag's value may equal it
        if word in args:
            del args[len(args) - 1 - args[::-1].index(word)]
    return shlex.join([*sys.argv[0].split(), verb, *args])


# Seconds after Ctrl-C (or SIGTERM) before the process ends without its KeyboardInterrupt: one
# raised inside a callback (a JAX GC hook during a cut, say) is printed as ignored and lost.
STOP_GRACE = 5.0


_EXITING = threading.Lock()


ON_STOP: list = []  # what a stop that ends the process this way still undoes (a half cut)


def _stop(signum, _frame):
    name = signal.Signals(signum).name
    threading.Thread(target=_exit_now, args=(name, STOP_GRACE), daemon=True).start()
    raise KeyboardInterrupt(name)


def _exit_now(name: str, after: float = 0.0) -> None:
    time.sleep(after)
    _EXITING.acquire()  # one line: the unwinding and the grace thread may both get here
    for undo in list(ON_STOP):
        undo()
    print("terminated" if name == "SIGTERM" else "interrupted", file=sys.stderr, flush=True)
    try:
        sys.stdout.flush()
    finally:  # at once: a thread still running must not hold the exit
        os._exit(143 if name == "SIGTERM" else 130)


def usage(doc: str, own) -> str:
    """The command's usage (its docstring) and its flags, each with its help and default."""
    lines = [doc.strip(), "", "flags:"]
    for f in own:
        req = any("other than None" in getattr(v, "message", "") for v in f.validators)
        tail = " (required)" if req else "" if f.default is None else f" (default: {f.default})"
        lines.append(textwrap.fill(f"  --{'[no]' if f.boolean else ''}{f.name}: {f.help}{tail}",
                                   100, subsequent_indent="      "))
    lines += ["", "Flags can also come from a file: --flagfile=FILE. --helpfull lists absl's too."]
    return "\n".join(lines)


def _parse(argv: list[str]) -> list[str]:
    """absl's flag parsing, its errors (a missing, unknown or malformed flag) as user errors."""
    try:
        return FLAGS(argv)
    except UnicodeDecodeError as e:  # absl reads --flagfile as UTF-8
        fail(f"a --flagfile is not UTF-8 text ({e.reason} at byte {e.start}); write it as text")
    except flags.Error as e:
        msg = re.sub(r"flag --(\w+)=None: Flag --\w+ must have a value other than None\.",
                     r"--\1 is required", str(e))
        fail(re.sub(r"^ERROR::\s*", "", msg).replace("\n", "; ") + " (see --help)")


def fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
