"""Run with the verifiers 0.4 venv's python (tests/integration/test_verifiers04.py): verifiers'
own `TrainClient` plays `turns` chat turns against one episode of the run's endpoint, its base
URL `{run}/e/{episode}/v1`, so its `/inference/v1/generate` calls land in that episode. Each turn
goes as verifiers' interception server sends it: the trace graph resolves the prompt
(`prepare_turn`), the client renders (bridging from the previous turn's tokens) and generates,
the turn is committed to the trace. Prints one JSON line per turn: the prompt ids the client
sent, the completion ids and logprobs it read back, its finish reason and content.

    python train_client_turns.py BASE_URL MODEL_DIR TURNS       (the token in $INFLIGHT_TOKEN)
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from renderers import CustomRendererConfig
from verifiers.v1 import TrainClientConfig
from verifiers.v1.clients.train import TrainClient
from verifiers.v1.configs.agent import AgentConfig
from verifiers.v1.dialects.chat import ChatDialect
from verifiers.v1.graph import prepare_turn
from verifiers.v1.trace import AgentInfo, Trace, TraceTask
from verifiers.v1.types import SamplingConfig


async def main(base_url: str, model_dir: str, turns: int) -> None:
    renderer = CustomRendererConfig(import_path=f"{Path(__file__).with_name('chatml_renderer.py')}:ChatMLBridge")
    client = TrainClient(TrainClientConfig(base_url=base_url, api_key_var="INFLIGHT_TOKEN", renderer=renderer,
                                           renderer_model_name=model_dir))
    dialect = ChatDialect()
    trace = Trace(task=TraceTask(type="Task", data={}), agent=AgentInfo(config=AgentConfig()))
    sampling = SamplingConfig(temperature=1.0, max_tokens=6)
    messages = [{"role": "user", "content": "Write digits:"}]
    try:
        for turn_number in range(turns):
            body = {"model": "tiny", "messages": messages}
            request = dialect.parse_request(body)
            turn = prepare_turn(trace, request.messages, request.tools)
            response = await client.get_response(dialect, body, sampling, session_id=trace.id, turn=turn)
            turn.commit(response)
            tokens = response.tokens
            print(json.dumps({"prompt_ids": tokens.prompt_ids, "completion_ids": tokens.completion_ids,
                              "logprobs": tokens.completion_logprobs, "finish_reason": response.finish_reason,
                              "content": response.message.content, "bridged": tokens.bridged}), flush=True)
            messages = messages + [{"role": "assistant", "content": response.message.content},
                                   {"role": "user", "content": f"Go on ({turn_number})."}]
    finally:
        await client.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
