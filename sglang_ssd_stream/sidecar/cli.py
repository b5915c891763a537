"""``sidecar build`` and ``sidecar verify`` subcommands, mounted by the kit's CLI.

Handlers return an exit code; failures are raised as :class:`sglang_ssd_stream.errors.KitError`
subclasses, which the caller prints and maps to ``exit_code``. Results go to stdout (``--json``
for a machine-readable object); progress bars and logs go to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import EXIT_OK, EXIT_USAGE, KitError


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def cmd_build(args: argparse.Namespace) -> int:
    from .build import build_sidecar

    if args.in_place:
        return _build_in_place(args)
    result = build_sidecar(
        args.checkpoint,
        args.output,
        split_ngram_parts=args.split_ngram_parts,
        layers=args.layers,
        expected_rows=args.rows,
        expected_columns=args.columns,
        force=args.force,
        verify=not args.no_verify,
        progress=not args.quiet,
        cache_dir=args.cache_dir,
    )
    if args.json:
        json.dump(result.to_json(), sys.stdout, indent=2)
        sys.stdout.write("\n")
        return EXIT_OK
    for t in result.manifest.tables:
        print(f"layer {t.layer}: {t.path}  {t.dtype} [{t.rows}, {t.columns}]  {_human(t.bytes)}  sha256 {t.sha256}")
    print(f"weight_scale: {result.scale_file or 'not found in the checkpoint'}")
    print(f"verified: {'skipped (--no-verify)' if result.verify is None else 'yes'}")
    print(f"wrote {result.manifest.path} in {result.seconds:.1f} s")
    return EXIT_OK


def _build_in_place(args: argparse.Namespace) -> int:
    from .in_place import build_in_place

    for flag, given in (("-o/--output", args.output is not None), ("--no-verify", args.no_verify)):
        if given:  # each would be ignored: refused instead
            raise _Usage(f"--in-place writes only ssd-stream.json into the checkpoint, hashing each region once; "
                         f"{flag} does not apply to it")
    result = build_in_place(args.checkpoint, split_ngram_parts=args.split_ngram_parts, layers=args.layers,
                            expected_rows=args.rows, expected_columns=args.columns, force=args.force,
                            progress=not args.quiet, cache_dir=args.cache_dir)
    if args.json:
        doc = result.to_json()
        for entry, t in zip(doc["tables"], result.manifest.tables, strict=True):
            entry["regions"] = len(t.regions)
            entry["files"] = sorted({r.path for r in t.regions})
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return EXIT_OK
    for t in result.manifest.tables:
        print(f"layer {t.layer}: in place, {len(t.regions)} regions of {len(t.files)} shard(s)  {t.dtype} "
              f"[{t.rows}, {t.columns}]  {_human(t.bytes)}")
    print(f"weight_scale: {result.scale_file or 'not found in the checkpoint'}")
    print(f"wrote {result.manifest.path} in {result.seconds:.1f} s (no copy; verified cache recorded)")
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    from .format import check_model_shape
    from .verify import REPORT, verify_sidecar
    from .view import load_sidecar

    manifest = load_sidecar(args.artifact, extra_roots=args.trusted_root or ())
    if args.dtype is not None or args.columns is not None or args.rows is not None:
        for t in manifest.tables:
            check_model_shape(t, dtype=args.dtype or t.dtype, columns=args.columns or t.columns, rows=args.rows)
    report = verify_sidecar(
        manifest,
        caller=REPORT,  # a report: reads the verified cache (with --use-cache), writes nothing
        use_cache=args.use_cache,
        cache_dir=args.cache_dir,
        progress=not args.quiet,
        layers=args.layers,
        raise_on_mismatch=False,
    )
    if args.json:
        json.dump(report.to_json(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        for c in report.tables:
            extra = f"  actual {c.actual_sha256}" if c.status == "mismatch" else ""
            t = manifest.table(c.layer)
            where = (f"in place, {len(t.regions)} regions of {len(t.files)} shard(s)"
                     + (f"; {c.detail}" if c.detail else "")) if t.in_place else c.path
            print(f"layer {c.layer}: {where}  {c.status}  sha256 {c.sha256}{extra}  "
                  f"({_human(c.bytes)}, {c.seconds:.1f} s)")
        print("OK" if report.ok else "FAILED")
    if not report.ok:
        from .errors import SidecarChecksumMismatch

        bad = [c for c in report.tables if c.status == "mismatch"]
        raise SidecarChecksumMismatch(
            f"PLE table {bad[0].path} (layer {bad[0].layer}) has SHA-256 {bad[0].actual_sha256}, "
            f"expected {bad[0].sha256}" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""),
            path=bad[0].path, actual=bad[0].actual_sha256, expected=bad[0].sha256,
        )
    return EXIT_OK


class _Usage(KitError):
    """A command line whose values do not fit together (argparse checks each alone)."""

    exit_code = EXIT_USAGE


def cmd_profile(args: argparse.Namespace) -> int:
    from .hot_rows import process_role
    from .profile import build_profile
    from .view import engine_trusted_roots, extra_trusted_roots, load_sidecar

    if not 0 <= args.tp_rank < args.tp_size:
        raise _Usage(f"--tp-rank {args.tp_rank} is not a rank of --tp-size {args.tp_size}")
    # the roots the engine's server trusts (its TRUSTED_ROOTS knob), and any named here
    roots = [*engine_trusted_roots(args.engine), *extra_trusted_roots(args.trusted_root or ())]
    manifest = load_sidecar(args.artifact, extra_roots=roots)
    role = args.role or process_role(args.engine, gpu=args.gpu, tp=args.tp_rank, pp=0)
    prof = build_profile(manifest, args.model, args.corpus, role=role, rows=args.rows, tp_rank=args.tp_rank,
                         tp_size=args.tp_size, shard_rule=args.shard_rule, path=args.out)
    if args.json:
        print(json.dumps({"path": str(prof.path), "role": role, "tp_rank": prof.tp_rank, "tp_size": prof.tp_size,
                          "row_range": {str(k): list(v) for k, v in prof.row_range.items()},
                          "tokens": prof.tokens, "rows": prof.rows, "distinct": prof.distinct}, indent=1))
    else:
        per = ", ".join(f"L{layer} [{prof.row_range[layer][0]}, {prof.row_range[layer][1]}): {n} of "
                        f"{prof.distinct[layer]} rows" for layer, n in sorted(prof.rows.items()))
        print(f"hot file {prof.path}: {prof.tokens} tokens profiled; {per}")
        print(f"the {args.engine} process with role {role} (TP rank {prof.tp_rank} of {prof.tp_size}) reads it at "
              f"start when its hot-file share is set (docs/hot-file.md)")
    return EXIT_OK


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: expected >= 1")
    return value


def add_profile_command(subparsers: argparse._SubParsersAction, engine: str, shard_rule=None
                        ) -> argparse.ArgumentParser:
    """``sidecar profile``: a hot file from a text corpus, for ``engine``'s serving process. ``shard_rule``
    (:data:`.profile.ShardRule`): the engine's TP split of a PLE table, passed in by the adapter (this floor imports
    no engine); without it, TP 1 only."""
    p = subparsers.add_parser(
        "profile", help="build a hot file from a text corpus, so a first start is warm too",
        description="Tokenize each corpus file with the model's tokenizer (one request each), hash it into each "
        "PLE table's row ids with the engine's n-gram hash, and write each table's most looked-up rows, with "
        "their bytes from the sidecar, to the hot file the serving process reads at start (docs/hot-file.md). "
        "The file is named for one process: its TP rank's rows of each table (the engine's own vocab-parallel "
        "split) and its role. Exit 0: written; 3: the model and the sidecar do not fit together, the engine "
        "does not split the tables over --tp-size, or the corpus is empty; 4: an I/O error; 64: bad command line.")
    p.add_argument("artifact", help="the sidecar: its directory or ssd-stream.json")
    p.add_argument("--model", required=True, metavar="DIR", help="the model directory (config.json, tokenizer)")
    p.add_argument("--trusted-root", action="append", metavar="DIR",
                   help="another directory table files may resolve into (repeatable; the engine's TRUSTED_ROOTS "
                        "knob counts too)")
    p.add_argument("--corpus", required=True, nargs="+", metavar="FILE", help="text files, one request each")
    p.add_argument("--rows", type=int, default=100_000, metavar="N",
                   help="rows per PLE table, most looked up first (default 100000; the server takes at most its "
                        "share of each row cache)")
    p.add_argument("--tp-size", type=_positive, default=1, metavar="N",
                   help="the server's TP size (default 1): each rank serves its own rows of each table")
    p.add_argument("--tp-rank", type=int, default=0, metavar="R",
                   help="the serving process's TP rank (default 0): its rows of each table, and its default role")
    p.add_argument("--gpu", type=int, default=0, help="the process's GPU index, for the default role (default 0)")
    p.add_argument("--role", help=f"the serving process's role (default {engine}-gpu<GPU>-tp<TP_RANK>-pp0; the server "
                   "names the file it looks for in its start-up warning)")
    p.add_argument("-o", "--out", metavar="PATH", help="write here instead of the kit's data directory")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=cmd_profile, engine=engine, shard_rule=shard_rule)
    return p


def add_sidecar_commands(subparsers: argparse._SubParsersAction, engine: str = "sglang", shard_rule=None
                         ) -> dict[str, argparse.ArgumentParser]:
    """Add ``build``, ``verify`` and ``profile`` to an argparse ``subparsers`` object (``shard_rule``: see
    :func:`add_profile_command`).

    Each parser gets ``set_defaults(func=handler)``; ``handler(args) -> int``. Returns the
    parsers by name.
    """
    b = subparsers.add_parser(
        "build",
        help="build a PLE sidecar (ssd-stream.json + ple/*.bin) from a checkpoint's PLE shards",
        description="Copy the PLE shard tensors of an HF-format checkpoint into raw row-major tables, "
        "write ssd-stream.json with their SHA-256, and copy the PLE weight_scale. Restart-safe. With --in-place, "
        "copy nothing: write only ssd-stream.json into the checkpoint, naming each shard tensor's byte region "
        "with its SHA-256 (refused, naming the tensor, for a tensor the engines would convert).",
    )
    b.add_argument("checkpoint", help="HF-format checkpoint directory (with the PLE shard tensors)")
    b.add_argument("--in-place", action="store_true",
                   help="serve the rows from the checkpoint's own shards: write only ssd-stream.json (no copy)")
    b.add_argument("-o", "--output", help="artifact directory to write (default: the checkpoint directory)")
    b.add_argument("--split-ngram-parts", type=int, metavar="N",
                   help="shards per table (default: config.json's split_ngram_parts, else 512)")
    b.add_argument("--layer", type=int, action="append", dest="layers", metavar="L",
                   help="only this decoder layer (repeatable; default: all)")
    b.add_argument("--rows", type=int, help="refuse tables without exactly this many rows")
    b.add_argument("--columns", type=int, help="refuse tables without exactly this many columns")
    b.add_argument("--force", action="store_true", help="replace an existing sidecar in the output directory")
    b.add_argument("--no-verify", action="store_true",
                   help="do not re-read the written tables to check their SHA-256")
    b.add_argument("--cache-dir", help="where to record verification if the output is read-only")
    b.add_argument("--json", action="store_true", help="print the result as JSON")
    b.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    b.set_defaults(func=cmd_build)

    v = subparsers.add_parser(
        "verify",
        help="check a sidecar's manifest, sizes and SHA-256",
        description="Validate ssd-stream.json and re-hash every table (ignoring the verified cache unless "
        "--use-cache). Writes nothing: the verified cache is recorded only by a serving engine's start and by "
        "the commands that write a sidecar (docs/sidecar.md).",
    )
    v.add_argument("artifact", help="artifact directory or its ssd-stream.json")
    v.add_argument("--use-cache", action="store_true",
                   help="accept earlier successful verifications of unchanged files")
    v.add_argument("--layer", type=int, action="append", dest="layers", metavar="L",
                   help="only this layer (repeatable)")
    v.add_argument("--dtype", choices=["float8_e4m3fn", "bfloat16"], help="expected table dtype")
    v.add_argument("--columns", type=int, help="expected row width in elements")
    v.add_argument("--rows", type=int, help="expected rows per table")
    v.add_argument("--trusted-root", action="append", metavar="DIR",
                   help="another directory table files may resolve into (repeatable)")
    v.add_argument("--cache-dir", help="the verified cache's fallback directory, read with --use-cache")
    v.add_argument("--json", action="store_true", help="print the report as JSON")
    v.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    v.set_defaults(func=cmd_verify)
    return {"build": b, "verify": v, "profile": add_profile_command(subparsers, engine, shard_rule)}
