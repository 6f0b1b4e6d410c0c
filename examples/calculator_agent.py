"""An agent with a calculator tool, written against the `openai` client alone (docs/training.md, "Agents").

    a3po train train_dataset.agent=examples.calculator_agent:run      # from the repository's root

The model may write <calc>expression</calc>; the agent computes it with a3po's arithmetic parser (model
text is data: it is parsed, never run as code) and sends the result back as the next user message.
A reply without a call is the final answer: reward 1 if its number is the reference's.
"""

import re

from a3po.data.rewards import canonical_number, extract_final_answer
from a3po.envs.arith import ArithError, evaluate, format_number

CALL = re.compile(r"<calc>(.*?)</calc>", re.S)
ASK = ("Use the calculator by writing <calc>expression</calc>, e.g. <calc>12 + 34</calc>; its result comes back "
       "as <result>value</result>. Then give the final answer as a number.")


async def run(example, client) -> float:
    messages = [{"role": "user", "content": f"{ASK} {example.question}"}]
    for _ in range(3):
        reply = await client.chat.completions.create(model="policy", messages=messages, stop=["</calc>"])
        text = reply.choices[0].message.content
        messages.append({"role": "assistant", "content": text})
        call = CALL.search(text)
        if call is None:  # the final answer
            answer = canonical_number(extract_final_answer(text))
            return float(answer is not None and answer == canonical_number(example.answer))
        try:
            result = format_number(evaluate(call.group(1)))
        except ArithError as e:
            result = f"error: {e}"
        messages.append({"role": "user", "content": f"<result>{result}</result>"})
    return 0.0
