"""A calculator agent built with the OpenAI Agents SDK (openai-agents), trained as it is (docs/training.md,
"Agent frameworks"). The SDK's own agent and tool-calling loop run unchanged; only its model is given the
episode's client.

    pip install 'a3po[agents,openai-agents]'           # make installs both
    a3po train train_dataset.agent=examples.openai_agents_agent:run train_dataset.tool_call_format=hermes

The tool computes with a3po's arithmetic parser (the model's expression is parsed, never run as code).
The final output's number, compared with the reference answer, is the reward.
"""

from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError

from a3po.data.rewards import canonical_number, extract_final_answer
from a3po.envs import arith

# The SDK exports traces to OpenAI's servers by default; a training run talks to its own endpoint only.
set_tracing_disabled(True)

# A chat template that renders no tools (SmolLM2's, the tiny models') shows the model only this text,
# so it says how a call is written.
INSTRUCTIONS = ("Answer the arithmetic question with a number. To compute, call the calculate tool: "
                '<tool_call>{"name": "calculate", "arguments": {"expression": "12 * (3 + 4)"}}</tool_call>')
MAX_TURNS = 4  # model calls per episode: at most train_dataset.max_turns (4 by default)


@function_tool
def calculate(expression: str) -> str:
    """The value of an arithmetic expression: numbers, + - * / and brackets."""
    return arith.calculate(expression)[0]


async def run(example, client) -> float:
    agent = Agent(name="calculator", instructions=INSTRUCTIONS, tools=[calculate],
                  model=OpenAIChatCompletionsModel(model="policy", openai_client=client))
    try:
        result = await Runner.run(agent, example.question, max_turns=MAX_TURNS)
    except (MaxTurnsExceeded, ModelBehaviorError):  # the model never answered, or called a tool that is not there
        return 0.0
    answer = canonical_number(extract_final_answer(str(result.final_output)))
    return float(answer is not None and answer == canonical_number(example.answer))
