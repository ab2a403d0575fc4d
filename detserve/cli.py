"""The engine's commands: ``detserve generate`` and ``detserve fetch-model``.

The ``detserve`` console (``services.console``) gathers these with the serving and load
generation commands; ``python -m detserve.cli`` runs them without the serving extras."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from detserve.flags import add_engine_flags
from detserve.flags import engine_kwargs as flag_values

Handler = Callable[[argparse.Namespace], int]
Subcommand = Callable[[str, str, Callable[[argparse.ArgumentParser], None]],
                      Callable[[Handler], Handler]]


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags shared by every command that builds an engine: one per engine option
    (``detserve.flags``)."""
    add_engine_flags(p)


def engine_kwargs(a: argparse.Namespace) -> dict[str, object]:
    """The engine options of parsed flags, for ``LLM(a.model, **...)``."""
    return flag_values(a)


def _generate_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--prompt", action="append", required=True,
                   help="prompt text (repeat for a batch)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--request-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--deterministic", action="store_true", help="ask for bit-exact output")
    p.add_argument("--logprobs", type=int, default=None)
    p.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]")
    p.add_argument("--logit-bias", action="append", default=[], metavar="TOKEN_ID=BIAS",
                   type=_bias_pair, help="add BIAS (in [-100, 100]) to a token's logit "
                                         "(repeatable)")
    p.add_argument("--json", action="store_true", help="print JSON lines")


def _bias_pair(text: str) -> tuple[int, float]:
    token, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID=BIAS, got {text!r}") from None


def _generate(a: argparse.Namespace) -> int:
    from detserve.llm import LLM
    from detserve.params import SamplingParams

    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p,
                            top_k=a.top_k, seed=a.request_seed,
                            is_deterministic=a.deterministic, logprobs=a.logprobs,
                            presence_penalty=a.presence_penalty,
                            frequency_penalty=a.frequency_penalty,
                            logit_bias=dict(a.logit_bias) or None)
    llm = LLM(a.model, **engine_kwargs(a))  # type: ignore[arg-type]
    if a.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in a.prompt], params)
    else:
        outs = llm.generate(a.prompt, params)
    for prompt, o in zip(a.prompt, outs, strict=True):
        if a.json:
            rec = {"prompt": prompt, "text": o.text, "token_ids": o.token_ids,
                   "finish_reason": o.finish_reason, "is_deterministic": o.is_deterministic}
            if o.logprobs is not None:
                rec["logprobs"] = [lp.logprob for lp in o.logprobs]
            print(json.dumps(rec))
        else:
            print(f"--- {prompt!r} ({o.finish_reason}, {len(o.token_ids)} tokens)")
            print(o.text)
    if a.deterministic:
        print(json.dumps({"determinism": llm.determinism_profile()}), file=sys.stderr)
    print(json.dumps({"stats": llm.stats()}), file=sys.stderr)
    return 0


def _fetch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?", default="smollm2", choices=["smollm2"])


def _fetch(a: argparse.Namespace) -> int:
    from detserve.model.fetch import fetch_smollm2

    print(fetch_smollm2())
    return 0


def register_detserve_commands(subcommand: Subcommand) -> None:
    """Hook read by the ``detserve`` console: adds ``generate`` and ``fetch-model``."""
    subcommand("generate", "generate text offline with the engine", _generate_args)(_generate)
    subcommand("fetch-model", "download the demo model into the local cache once",
               _fetch_args)(_fetch)


def build_parser(registrars: Sequence[Callable[[Subcommand], None]],
                 prog: str = "detserve") -> argparse.ArgumentParser:
    """A parser with the ``registrars``' subcommands; each sets ``args.handler``."""
    parser = argparse.ArgumentParser(prog=prog)
    sub = parser.add_subparsers(dest="command", required=True)

    def subcommand(name: str, help: str, configure: Callable[[argparse.ArgumentParser], None]
                   ) -> Callable[[Handler], Handler]:
        def deco(fn: Handler) -> Handler:
            p = sub.add_parser(name, help=help)
            configure(p)
            p.set_defaults(handler=fn)
            return fn
        return deco

    for register in registrars:
        register(subcommand)
    return parser


def run(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run its command; a bad value (ValueError and the like) becomes a
    one-line message and exit status 2."""
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args))
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"{parser.prog} {args.command}: error: {e}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser([register_detserve_commands]), argv)


if __name__ == "__main__":
    sys.exit(main())
