"""Commands that need a running server: ``checkpoint`` (snapshot it to its remote tier)
and ``console`` (serve the web console for it: ``expstore_server.console``)."""

from __future__ import annotations

from .errors import CliError


def cmd_checkpoint(b, args, out) -> int:
    infos = b.checkpoint(args.name)
    for shard, info in ({"": infos} if "uri" in infos else infos).items():  # sharded: one per shard
        out.write(f"{f'shard {shard}: ' if shard else ''}checkpoint {info['name']}: {info['num_bytes']} bytes "
                  f"to {info['uri']} in {info['seconds']:.2f} s\n")
    return 0


def run_console(args) -> int:
    """``expstore console``: a session per browser token, not one backend."""
    if args.data_dir or args.remote:
        raise CliError("console needs a running server (--server), not --data-dir or --remote")
    try:
        from ..console.serve import run
    except ImportError as e:
        raise CliError(f"console needs the console extra (pip install 'expstore[console]'): {e}") from None
    return run(args)
