"""Environments for the multi-turn tests (`env.name=tests.env_fixtures:Class`), importable by the worker processes."""
import random
import signal
import time

from aligner.envs import Environment

# observation texts that a decode -> encode round trip would not give back token for token: role markers and
# eos written as text, bytes split across characters, spaces and newlines at the edges
AWKWARD = ["<eos>", "<|user|>", " 12", "12 ", "\n\n", "é", "→∑", "<|assistant|>x", "  ", "a<pad>b", "7+5=", "🙂"]


class Scripted(Environment):
    """Random but reproducible: the record's `seed` fixes how many tool turns come before the end and what
    each observation is (text or a message list, often awkward), and the reward is the number of characters
    the model wrote in its last turn."""

    def reset(self, record):
        self.rng, self.left = random.Random(record["seed"]), record["tool_turns"]
        self.actions = []
        return None

    def step(self, action):
        self.actions.append(action)
        if self.left == 0:
            return None, float(len(action)), True
        self.left -= 1
        text = "".join(self.rng.choice(AWKWARD) for _ in range(self.rng.randint(0, 4)))
        if self.rng.random() < 0.3:
            return [{"role": "tool", "content": text}, {"role": "system", "content": "go on"}], None, False
        return text, None, False


class Endless(Environment):
    """Never done: an observation after every turn."""

    def reset(self, record):
        return None

    def step(self, action):
        return "ok", 0.25, False


class Slow(Environment):
    """0.5 s of tool latency a turn; done after the third turn with reward 1."""

    def reset(self, record):
        self.turns = 0

    def step(self, action):
        time.sleep(0.5)
        self.turns += 1
        return ("done", 1.0, True) if self.turns == 3 else ("result", None, False)


class Raises(Environment):
    def reset(self, record):
        self.fail_at = record.get("fail_at", 1)
        self.turns = 0

    def step(self, action):
        self.turns += 1
        if self.turns >= self.fail_at:
            raise RuntimeError("the tool broke")
        return "fine", None, False


class Hangs(Environment):
    """Sleeps far past any deadline at the record's `hang_at` step (1 = the first); `stubborn`: ignores SIGALRM
    first, as code stuck in C would, so only the host can stop it."""

    def reset(self, record):
        self.hang_at, self.stubborn, self.turns = record.get("hang_at", 1), record.get("stubborn", False), 0

    def step(self, action):
        self.turns += 1
        if self.turns >= self.hang_at:
            if self.stubborn:
                signal.signal(signal.SIGALRM, signal.SIG_IGN)
            time.sleep(1000)
        return "fine", None, False


class Garbage(Environment):
    """Returns the record's `kind` of garbage at the first step."""

    def reset(self, record):
        self.kind = record["kind"]

    def step(self, action):
        return {"tuple": "not a tuple", "nan": ("x", float("nan"), False), "done": ("x", 1.0, "yes"),
                "observation": (42, None, False),
                "message": ([{"role": "tool", "content": object()}], None, False)}[self.kind]


class Unbuildable(Environment):
    def __init__(self, **options):
        raise RuntimeError("no tool here")

    def reset(self, record):
        return None

    def step(self, action):
        return None, None, True


class NoStep:
    def reset(self, record):
        return None


class Mixed(Environment):
    """The record's `mode`: "ok" (done at the second step, reward 1), "first" (as ok, with a first observation
    from reset that replaces the prompt), "reset" (reset raises), "raise", "hang" (past any deadline) or
    "garbage" (a string for a reward), each at the first step."""

    def reset(self, record):
        self.mode, self.turns = record["mode"], 0
        if self.mode == "reset":
            raise KeyError("no such task")
        return [{"role": "user", "content": "use the tool"}] if self.mode == "first" else None

    def step(self, action):
        self.turns += 1
        if self.mode == "raise":
            raise ValueError("bad tool")
        if self.mode == "hang":
            time.sleep(1000)
        if self.mode == "garbage":
            return "x", "one", False
        return ("fine", None, False) if self.turns < 2 else (None, 1.0, True)
