"""The data side: tasks and their held-out split (`tasks`), reward functions and safe calls (`rewards`).

    from a3po.data import load_task, build_reward, SafeReward, build_messages
"""

from a3po.data.rewards import RewardFn, SafeReward, build_reward, extract_final_answer, extract_final_expression
from a3po.data.tasks import DataError, Example, TaskData, build_messages, load_task

__all__ = [
    "DataError", "Example", "RewardFn", "SafeReward", "TaskData", "build_messages", "build_reward",
    "extract_final_answer", "extract_final_expression", "load_task",
]
