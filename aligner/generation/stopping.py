"""Stop rules and response extraction for a slot-indexed generation buffer.

The engine keeps one [B, S] token buffer per batch where slot s holds position s of the sample
(prompt first, then its response). A sample's response occupies slots [P_b, P_b + n_b).
"""
from __future__ import annotations

from typing import Sequence

import torch

from aligner.generation.types import STOP_EOS, STOP_LENGTH, STOP_STRING, STOP_TOKEN


def stop_token_tensor(eos_id: int | None, stop_token_ids: Sequence[int], device) -> torch.Tensor:
    """Sorted unique ids that end a sample (eos and the stop tokens)."""
    ids = set(stop_token_ids) | ({eos_id} if eos_id is not None else set())
    return torch.tensor(sorted(ids), dtype=torch.int64, device=device)


class StopStrings:
    """Host-side stop-string matcher: decodes each running sample's response after every token.

    Costs a tokenizer decode per running sample per step, so it is only built when stop strings
    are given. A stop string may span several tokens; special tokens are not decoded.
    """

    def __init__(self, tokenizer, stop_strings: Sequence[str], batch: int):
        if tokenizer is None:
            raise ValueError("stop_strings need a tokenizer: pass tokenizer= to the engine")
        self.tokenizer, self.strings = tokenizer, tuple(stop_strings)
        self.responses: list[list[int]] = [[] for _ in range(batch)]
        self.hit = [False] * batch

    def update(self, tokens: list[int], generating: list[bool]) -> list[int]:
        """Append this step's token to each generating sample; return the rows that now match."""
        matched = []
        for row, (token, on) in enumerate(zip(tokens, generating)):
            if not on:
                continue
            self.responses[row].append(token)
            text = self.tokenizer.decode(self.responses[row], skip_special_tokens=True)
            if any(s in text for s in self.strings):
                self.hit[row] = True
                matched.append(row)
        return matched


def extract_responses(buffer: torch.Tensor, slot_logprobs: torch.Tensor, prompt_lengths: torch.Tensor,
                      response_lengths: torch.Tensor, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Responses [B, T] (right-padded with pad_id) and their log-probs (0-padded), T = longest response."""
    width = max(int(response_lengths.max()), 1)
    steps = torch.arange(width, device=buffer.device)
    index = (prompt_lengths[:, None] + steps[None, :]).clamp(max=buffer.shape[1] - 1)
    inside = steps[None, :] < response_lengths[:, None]
    ids = buffer.gather(1, index).masked_fill(~inside, pad_id)
    logprobs = slot_logprobs.gather(1, index).masked_fill(~inside, 0.0)
    return ids, logprobs


def stop_reasons(responses: list[list[int]], string_hits: Sequence[bool], eos_id: int | None,
                 stop_token_ids: Sequence[int]) -> list[str]:
    """Why each sample ended, from its last token and whether a stop string matched."""
    stops = set(stop_token_ids)
    reasons = []
    for ids, string_hit in zip(responses, string_hits):
        last = ids[-1] if ids else None
        if last is not None and last == eos_id:
            reasons.append(STOP_EOS)
        elif last in stops:
            reasons.append(STOP_TOKEN)
        elif string_hit:
            reasons.append(STOP_STRING)
        else:
            reasons.append(STOP_LENGTH)
    return reasons
