"""On-policy reinforcement learning (GRPO and its variants): the pieces beside the objective.

The loss and its options live with the other objectives (titanlike/objectives/grpo.py); this
package holds what RL adds around them: the reward functions users write (rewards.py).
"""

from titanlike.rl.rewards import Reward, RewardError, check_columns, compute_rewards, load_reward, load_rewards

__all__ = ["Reward", "RewardError", "check_columns", "compute_rewards", "load_reward", "load_rewards"]
