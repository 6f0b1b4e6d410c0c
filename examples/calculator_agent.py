"""An agent with a calculator tool, written against the `openai` client alone (docs/training.md, "Agents").

    a3po train train_dataset.agent=examples.calculator_agent:run      # from the repository's root

The model may write <calc>expression</calc>; the agent computes it with a3po's arithmetic parser (model
text is data: it is parsed, never run as code) and sends the result back as the next user message.
A reply without a call is the final answer: reward 1 if its number is the reference's.
"""

from a3po.data.rewards import canonical_number, extract_final_answer
from a3po.envs.arith import calculate

ASK = ("Use the calculator by writing <calc>expression</calc>, e.g. <calc>12 + 34</calc>; its result comes back "
       "as <result>value</result>. Then give the final answer as a number.")


async def run(example, client) -> float:
    messages = [{"role": "user", "content": f"{ASK} {example.question}"}]
    for _ in range(3):
        reply = await client.chat.completions.create(model="policy", messages=messages, stop=["</calc>"])
        text = reply.choices[0].message.content  # cut before the stop string, as the protocol's replies are
        messages.append({"role": "assistant", "content": text})
        if "<calc>" not in text:  # the final answer
            answer = canonical_number(extract_final_answer(text))
            return float(answer is not None and answer == canonical_number(example.answer))
        result, _ = calculate(text.rsplit("<calc>", 1)[1])
        messages.append({"role": "user", "content": f"<result>{result}</result>"})
    return 0.0
