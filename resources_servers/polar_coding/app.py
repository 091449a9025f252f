"""NeMo Gym entry point of polar-mitm's coding tasks; the code is polar_mitm/nemo_gym/coding_server.py."""

from polar_mitm.nemo_gym.coding_server import CodingTasksServer

if __name__ == "__main__":
    CodingTasksServer.run_webserver()
