"""`kernjax timeline`: per-stage period, held and wait from the stages' `pp item` log lines."""

from __future__ import annotations

from pathlib import Path

from absl import flags


def main_def():
    """Usage: kernjax timeline LOG... [--png FILE] [--first K] [--last K] [--width N]

Reads the `pp item` lines of the stages' logs (kernjax serve --log_dir) and prints each stage's
period, held and wait time per item, then a text gantt of the items (--png: also as a picture)."""
    flags.DEFINE_string("png", None, "also draw the gantt to this PNG file")
    flags.DEFINE_integer("first", 1, "the first item counted in the report and drawn (item 0 has "
                         "no previous item, so no period)", lower_bound=0)
    flags.DEFINE_integer("last", None, "the last item counted and drawn (default: the last on "
                         "every stage; the gantt draws 20 from --first)")
    flags.DEFINE_integer("width", 120, "columns of the text gantt", upper_bound=10000)
    FLAGS = flags.FLAGS

    def main(logs=()):
        if not logs:
            raise ValueError("give the stages' log files: kernjax timeline LOG... "
                             "[--png FILE]")
        lines = []
        for log in map(Path, logs):
            if not log.is_file():
                raise ValueError(f"log `{log}` is not a file")
            lines += log.read_text(errors="replace").splitlines()
        if FLAGS.last is not None and FLAGS.last < FLAGS.first:
            raise ValueError(f"--last {FLAGS.last} is before --first {FLAGS.first}")
        from kernjax.serve.timeline import gantt, parse, png, report
        items = parse(lines)
        print(report(items, first=FLAGS.first, last=FLAGS.last))
        print()
        print(gantt(items, first=FLAGS.first, last=FLAGS.last, width=FLAGS.width))
        if FLAGS.png:
            print(f"wrote {png(items, FLAGS.png, first=FLAGS.first, last=FLAGS.last)}")

    main.takes_args = True
    return main

