"""`aligner serve verifier [verifier=arithmetic|math|code|code_all] [server.port=P]`: rule-based rewards.

Endpoint `verifier` (`protocol.VERIFIER`): the responses, as text (`sentences`) or as token ids with
lengths (decoded with `tokenizer`), and the reference `answers`, in; `rewards` [B, 1] out. Send the
response only: the rules look for the answer at its end. The code verifiers take each response's tests as
JSON text in `answers` (`aligner.rewards.code`) and run the rows of a call, merged requests included, in
parallel. One process, no model, no GPU.
"""
from __future__ import annotations

import logging

import numpy as np

from aligner.data.tokenizer import load_tokenizer
from aligner.observe.logs import configure_logging
from aligner.rewards import get_verifier, verify_rows
from aligner.servers.config import load_resolved_serve_config
from aligner.servers.protocol import VERIFIER, RequestError, check_rows, check_tokens, decode_texts
from aligner.servers.triton import Binding, serve_bindings

log = logging.getLogger(__name__)


def main(argv: list[str]) -> None:
    run(load_resolved_serve_config(argv[0], "verifier"))


def run(cfg) -> None:
    configure_logging(0)
    rule = get_verifier(cfg.verifier)
    tokenizer = load_tokenizer(cfg.tokenizer) if cfg.tokenizer else None
    max_rows = cfg.server.max_batch_size

    def responses(request) -> list[str]:
        if "sentences" in request:
            return decode_texts(request, max_rows=max_rows)
        if "tokens" not in request:
            raise RequestError("send the responses as 'sentences', or as 'tokens' and 'sequence_lengths'")
        if tokenizer is None:
            raise RequestError("this verifier has no tokenizer to decode 'tokens'; send 'sentences' or start it "
                               "with tokenizer=DIR")
        tokens, lengths = check_tokens(request, max_rows=max_rows, max_length=cfg.server.max_seq_length or 1 << 20,
                                       vocab_size=len(tokenizer))
        return [tokenizer.decode(row[:n].tolist(), skip_special_tokens=True) for row, n in zip(tokens, lengths)]

    def verify(requests):
        texts, answers, sizes = [], [], []
        for i, request in enumerate(requests):
            try:
                rows, references = responses(request), decode_texts(request, "answers", max_rows=max_rows)
                if len(references) != len(rows):
                    raise RequestError(f"'answers' has {len(references)} rows but there are {len(rows)} responses")
                check_rows(len(rows), max_rows)
            except RequestError as e:
                where = f"request {i + 1} of the {len(requests)} merged in this call: " if len(requests) > 1 else ""
                raise RequestError(f"{where}{e}") from None
            texts += rows
            answers += references
            sizes.append(len(rows))
        rewards = np.array(verify_rows(rule, texts, answers), dtype=np.float32).reshape(-1, 1)
        return [{"rewards": part} for part in np.split(rewards, np.cumsum(sizes)[:-1])]

    serve_bindings(cfg.server, cfg.run_dir, [Binding(VERIFIER, verify, max_rows)])
