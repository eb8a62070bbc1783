"""Train on gsm8k_math: the script users copy. Edit the YAML beside it, or pass --section.key=value overrides.

On a GPU, from the repository's root (the YAML reads ../shared/data/gsm8k/train.jsonl from there, all but its
last 500 rows; add --env.data=null --env.data_rows=null to train on the built-in generated problems instead):

    python examples/train_gsm8k_math.py [--optim.lr=1e-6 ...]

On a CPU the YAML's sizes are a GPU's; pass the sizes `agentrl train` picks without one, and few steps (the
warm-up must fit in them):

    python examples/train_gsm8k_math.py --steps=3 --optim.warmup_steps=0 --rollout.group_size=4 \\
        --rollout.groups_per_step=1 --rollout.rollouts_in_flight=8 --rollout.max_new_tokens=128

(--model.name=tiny-qwen3 for a random-weight model that runs in seconds, to check the wiring.)
"""

import sys
from pathlib import Path

# From the modules themselves: the package's lazily exported `train` is shadowed by its submodule of that name
# once the submodule is imported.
from agentrl.run.config import TrainConfig
from agentrl.run.train import train

if __name__ == "__main__":
    config = TrainConfig.from_yaml(Path(__file__).with_suffix(".yaml"), overrides=sys.argv[1:])
    print(train(config))
