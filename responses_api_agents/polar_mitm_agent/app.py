"""NeMo Gym entry point of polar-mitm's agent; the code is polar_mitm/nemo_gym/agent.py."""

from polar_mitm.nemo_gym.agent import PolarMitmAgent

if __name__ == "__main__":
    PolarMitmAgent.run_webserver()
