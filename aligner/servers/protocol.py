"""The wire protocol: every endpoint's tensors (name, dtype, shape), and the request checks that the
servers apply and the client applies before sending. Shared by both sides; numpy only.

Shapes of batched endpoints exclude the batch dimension, as PyTriton declares them: `(-1,)` is
one variable-length axis, so `tokens` travels as [B, S]. Endpoints that are not batched (one
request = one call: training, saving) declare their full shapes. Conventions:
* `tokens` int64 [B, S] are right-padded; `sequence_lengths` int64 [B, 1] counts each row's real
  tokens (1..S); ids past a row's length are ignored (the server zeroes them).
* Text travels as UTF-8 bytes in `sentences` [B, 1]; the reward server tokenizes it the way
  reward-model training does (`aligner.data.preference_rm.encode_for_reward`).
* `rewards` float32 [B, A]: A = 1, or one column per attribute of a regression reward model.
* Critic `values` float32 [B, S]: values[b, t] is the value of the prefix ending at token t; it is 0
  at t >= sequence_lengths[b]. `critic_train` takes `returns`, `prev_values` and `mask` aligned the
  same way; positions with mask 0 do not count.
* Critic checkpoints are named by the actor's step: `critic_save` and `critic_load` take `step`
  int64 [1], the actor's step, so that an actor checkpoint at step N has a critic checkpoint for N.
* `seconds` (float32) is the server's own wall time for the work of the call that carried the request
  (requests the dynamic batcher merged into one call each report that call's time).
NeMo-Aligner's names are kept (reward_model / critic_infer / critic_train / critic_save, tokens,
sequence_lengths, sentences, rewards, values, returns, prev_values, mask, loss_mean), so its clients
can talk to these servers, except that `critic_save` takes the actor's `step` where NeMo-Aligner
sends a `dummy_var`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TRAIN_MAX_ROWS = 1 << 16  # critic_train takes a whole rollout batch in one request (checked by the server)


class RequestError(ValueError):
    """A request breaks the protocol; the message names the input and says what was expected."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: type  # numpy scalar type: np.int64, np.float32, np.bytes_
    shape: tuple  # without the batch dimension; -1 = any length
    optional: bool = False


@dataclass(frozen=True)
class Endpoint:
    """One PyTriton model. `batched`: requests may be merged by the dynamic batcher (inference),
    and shapes exclude the batch dimension; otherwise each request is one call (a training step, a
    save) and shapes are complete. `idempotent`: the client may resend it after the connection
    dropped mid-request."""

    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    batched: bool = True
    idempotent: bool = True

    def input(self, name: str) -> TensorSpec:
        return next(t for t in self.inputs if t.name == name)


TOKENS = TensorSpec("tokens", np.int64, (-1,))
LENGTHS = TensorSpec("sequence_lengths", np.int64, (1,))
SENTENCES = TensorSpec("sentences", np.bytes_, (1,), optional=True)
ANSWERS = TensorSpec("answers", np.bytes_, (1,))
_TEXT_OR_TOKENS = (TensorSpec("tokens", np.int64, (-1,), optional=True),
                   TensorSpec("sequence_lengths", np.int64, (1,), optional=True), SENTENCES)


def reward_endpoint(num_outputs: int = 1) -> Endpoint:
    """`reward_model`: token ids + lengths, or text -> rewards [B, num_outputs]."""
    return Endpoint("reward_model", _TEXT_OR_TOKENS, (TensorSpec("rewards", np.float32, (num_outputs,)),))


# The critic's tensors besides tokens/sequence_lengths/rewards; not batched ones have full shapes.
VALUES = TensorSpec("values", np.float32, (-1,))
SECONDS = TensorSpec("seconds", np.float32, (1,))
RETURNS = TensorSpec("returns", np.float32, (-1, -1))
PREV_VALUES = TensorSpec("prev_values", np.float32, (-1, -1))
MASK = TensorSpec("mask", np.float32, (-1, -1))
LOSS_MEAN = TensorSpec("loss_mean", np.float32, (1,))  # the mean over optimizer steps of each step's token mean
CLIP_FRACTION = TensorSpec("clip_fraction", np.float32, (1,))  # clipped / masked tokens over all the steps
STEP = TensorSpec("step", np.int64, (1,))  # the actor's step


def critic_infer_endpoint(reward_outputs: int = 0) -> Endpoint:
    """`critic_infer`: values [B, S] and seconds [B, 1]; with a co-hosted reward model also its
    rewards [B, A]."""
    outputs = (VALUES, SECONDS)
    if reward_outputs:
        outputs += (TensorSpec("rewards", np.float32, (reward_outputs,)),)
    return Endpoint("critic_infer", (TOKENS, LENGTHS), outputs)


CRITIC_TRAIN = Endpoint("critic_train", (TensorSpec("tokens", np.int64, (-1, -1)), RETURNS, PREV_VALUES, MASK),
                        (LOSS_MEAN, CLIP_FRACTION, SECONDS), batched=False, idempotent=False)
# Saving or loading the same step twice leaves the same state: both may be resent.
CRITIC_SAVE = Endpoint("critic_save", (STEP,), (STEP,), batched=False)
CRITIC_LOAD = Endpoint("critic_load", (STEP,), (STEP,), batched=False)
VERIFIER = Endpoint("verifier", (*_TEXT_OR_TOKENS, ANSWERS), (TensorSpec("rewards", np.float32, (1,)),))


# ---- checks -------------------------------------------------------------------------------------------
def _array(inputs: dict, spec: TensorSpec, ndim: int) -> np.ndarray:
    value = inputs.get(spec.name)
    if value is None:
        raise RequestError(f"input '{spec.name}' is missing")
    value = np.asarray(value)
    if spec.dtype is np.bytes_:
        if value.dtype.kind not in "SO":
            raise RequestError(f"input '{spec.name}' must be bytes (UTF-8 text), got {value.dtype}")
    elif value.dtype != spec.dtype:
        raise RequestError(f"input '{spec.name}' must be {np.dtype(spec.dtype).name}, got {value.dtype.name}")
    if value.ndim != ndim:
        raise RequestError(f"input '{spec.name}' must have {ndim} dimensions [batch, ...], got shape {value.shape}")
    return value


def check_rows(rows: int, max_rows: int) -> None:
    if rows < 1:
        raise RequestError("the request has no rows")
    if rows > max_rows:
        raise RequestError(f"the request has {rows} rows, more than this server's max_batch_size={max_rows}; "
                           f"split it")


def check_tokens(inputs: dict, *, max_rows: int, max_length: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """`tokens` [B, S] and `sequence_lengths` [B, 1] -> (tokens with zeroed padding, lengths [B])."""
    tokens = _array(inputs, TOKENS, 2)
    lengths = _array(inputs, LENGTHS, 2)
    rows, width = tokens.shape
    check_rows(rows, max_rows)
    if lengths.shape != (rows, 1):
        raise RequestError(f"'sequence_lengths' must have shape [{rows}, 1] to match 'tokens' {list(tokens.shape)}, "
                           f"got {list(lengths.shape)}")
    lengths = lengths[:, 0]
    if width > max_length:
        raise RequestError(f"'tokens' has {width} positions, more than this server's max_seq_length={max_length}")
    bad = np.flatnonzero((lengths < 1) | (lengths > width))
    if bad.size:
        raise RequestError(f"sequence_lengths[{bad[0]}]={lengths[bad[0]]} is outside [1, {width}] (the width of "
                           f"'tokens')")
    real = np.arange(width)[None, :] < lengths[:, None]
    out = (tokens < 0) | (tokens >= vocab_size)
    if (out & real).any():
        row, col = np.argwhere(out & real)[0]
        raise RequestError(f"token id {tokens[row, col]} at tokens[{row}, {col}] is outside the vocabulary "
                           f"[0, {vocab_size})")
    return np.where(real, tokens, 0), lengths


def decode_texts(inputs: dict, name: str = "sentences", *, max_rows: int) -> list[str]:
    """A bytes [B, 1] input -> B strings."""
    spec = ANSWERS if name == "answers" else SENTENCES
    array = _array(inputs, spec, 2)
    check_rows(array.shape[0], max_rows)
    if array.shape[1] != 1:
        raise RequestError(f"'{name}' must have shape [batch, 1], got {list(array.shape)}")
    texts = []
    for i, item in enumerate(array[:, 0]):
        try:
            texts.append(item.decode("utf-8") if isinstance(item, bytes) else str(item))
        except UnicodeDecodeError:
            raise RequestError(f"{name}[{i}] is not valid UTF-8") from None
    return texts


def check_float_like(inputs: dict, spec: TensorSpec, shape: tuple[int, int]) -> np.ndarray:
    value = _array(inputs, spec, 2)
    if value.shape != shape:
        raise RequestError(f"'{spec.name}' must have shape {list(shape)} (like 'tokens'), got {list(value.shape)}")
    if not np.isfinite(value).all():
        raise RequestError(f"'{spec.name}' has non-finite values")
    return value


def check_step(inputs: dict) -> int:
    """`step` int64 [1] (critic_save / critic_load) -> the step, which must be >= 0."""
    value = _array(inputs, STEP, 1)
    if value.shape != (1,) or value[0] < 0:
        raise RequestError(f"'step' must be one actor step >= 0, shape [1], got {value.tolist()}")
    return int(value[0])


def pad_token_rows(rows: list, pad_to_multiple: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Token id lists -> right-padded `tokens` int64 [B, S] (S = the longest, rounded up to a
    multiple) and `sequence_lengths` int64 [B, 1]."""
    width = max(len(r) for r in rows)
    width = -(-width // pad_to_multiple) * pad_to_multiple
    tokens = np.zeros((len(rows), width), dtype=np.int64)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = r
    return tokens, np.array([[len(r)] for r in rows], dtype=np.int64)


def text_array(texts: list[str]) -> np.ndarray:
    """Strings -> a bytes [B, 1] input (object array of UTF-8 bytes)."""
    return np.array([[t.encode("utf-8")] for t in texts], dtype=object)
