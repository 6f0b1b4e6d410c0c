"""The data side: tasks and their held-out split (`tasks`), reward functions (`rewards`) and
calls to them that a timeout really ends (`scoring`).

    from a3po.data import load_task, build_reward, RewardProcess, build_messages
"""

from a3po.data.rewards import RewardFn, build_reward, extract_final_answer, extract_final_expression
from a3po.data.scoring import CallProcess, RewardProcess
from a3po.data.tasks import DataError, Example, TaskData, build_messages, load_task

__all__ = [
    "CallProcess", "DataError", "Example", "RewardFn", "RewardProcess", "TaskData", "build_messages", "build_reward",
    "extract_final_answer", "extract_final_expression", "load_task",
]
