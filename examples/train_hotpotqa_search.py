"""Train on hotpotqa_search: the script users copy. Edit the YAML beside it, or pass --section.key=value overrides.

    python examples/train_hotpotqa_search.py [--optim.lr=1e-6 ...]
"""

import sys
from pathlib import Path

from agentrl.run import TrainConfig, train

if __name__ == "__main__":
    config = TrainConfig.from_yaml(Path(__file__).with_suffix(".yaml"), overrides=sys.argv[1:])
    print(train(config))
