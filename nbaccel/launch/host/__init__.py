"""This machine: its processes, its capacity and RAM, its ports and addresses, the logs kept on
its disk."""
