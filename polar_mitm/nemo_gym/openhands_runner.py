"""OpenHands SDK's agent, headless, as a farm runs it: ``python openhands_runner.py MODEL PROMPT``
with the interpreter of the venv that holds ``openhands-sdk`` and ``openhands-tools``
(scripts/install_py_harnesses.sh), in the task's workspace.

The SDK has no command of its own; this is the smallest runner of its public API, the one
Polar's preset uses: an ``LLM`` for ``openai/<model>`` (LiteLLM's OpenAI provider at its
default host, the key from OPENAI_API_KEY), the SDK's default agent in CLI mode (terminal, file
editor, task tracker; its condenser, which compacts a long history with a side call of its
own), a ``Conversation`` in the current directory, the task sent and run to the agent's finish.
The agent's last message is printed last. Nothing of polar-mitm is imported: this runs in the
harness's venv, which does not have it.
"""

from __future__ import annotations

import os
import sys


def main() -> int:
    if len(sys.argv) != 3:
        print("usage: openhands_runner.py MODEL PROMPT", file=sys.stderr)
        return 2
    model, prompt = sys.argv[1], sys.argv[2]
    from openhands.sdk import LLM, Conversation
    from openhands.sdk.conversation.response_utils import get_agent_final_response
    from openhands.tools.preset.default import get_default_agent

    llm = LLM(model=f"openai/{model}", api_key=os.environ["OPENAI_API_KEY"], usage_id="agent")
    agent = get_default_agent(llm=llm, cli_mode=True)
    conversation = Conversation(agent=agent, workspace=os.getcwd())
    conversation.send_message(prompt)
    conversation.run()
    print(get_agent_final_response(conversation.state.events))
    return 0


if __name__ == "__main__":
    sys.exit(main())
