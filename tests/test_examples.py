"""examples/rollout.py run as a user runs it: the reward its REINFORCE steps optimise rises, and
podrun's log-probabilities of the sampled tokens are the trainer's own forward pass's."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_rollout_loop_raises_its_reward_with_podrun_sampling():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    p = subprocess.run([sys.executable, "examples/rollout.py", "--steps=12"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [(float(r), float(g)) for r, g in re.findall(
        r"reward (\S+)\s+\|podrun - trainer\| logprob (\S+)", p.stdout)]
    assert len(rows) == 12
    rewards = [r for r, _ in rows]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards
    assert max(g for _, g in rows) < 1e-4, rows
