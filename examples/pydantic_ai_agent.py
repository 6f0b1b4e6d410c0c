"""A calculator agent built with Pydantic AI (pydantic-ai-slim), trained as it is (docs/training.md,
"Agent frameworks"). Pydantic AI's own agent and tool-calling loop run unchanged; only its model's
provider is given the episode's client.

    pip install 'a3po[agents,pydantic-ai]'             # make installs both
    a3po train train_dataset.agent=examples.pydantic_ai_agent:run train_dataset.tool_call_format=hermes

The tool computes with a3po's arithmetic parser (the model's expression is parsed, never run as code).
The final output's number, compared with the reference answer, is the reward.
"""

from pydantic_ai import Agent, UsageLimits
from pydantic_ai.exceptions import UnexpectedModelBehavior, UsageLimitExceeded
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from a3po.data.rewards import canonical_number, extract_final_answer
from a3po.envs import arith

# A chat template that renders no tools (SmolLM2's, the tiny models') shows the model only this text,
# so it says how a call is written.
INSTRUCTIONS = ("Answer the arithmetic question with a number. To compute, call the calculate tool: "
                '<tool_call>{"name": "calculate", "arguments": {"expression": "12 * (3 + 4)"}}</tool_call>')
MAX_TURNS = 4  # model calls per episode: at most train_dataset.max_turns (4 by default)


def calculate(expression: str) -> str:
    """The value of an arithmetic expression: numbers, + - * / and brackets."""
    return arith.calculate(expression)[0]


async def run(example, client) -> float:
    model = OpenAIChatModel("policy", provider=OpenAIProvider(openai_client=client))
    agent = Agent(model, instructions=INSTRUCTIONS, tools=[calculate])
    try:
        result = await agent.run(example.question, usage_limits=UsageLimits(request_limit=MAX_TURNS))
    except (UsageLimitExceeded, UnexpectedModelBehavior):  # the model never answered, or its calls never validated
        return 0.0
    answer = canonical_number(extract_final_answer(result.output))
    return float(answer is not None and answer == canonical_number(example.answer))
