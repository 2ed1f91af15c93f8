"""The rank side of a launch: the rank's main loop and the state it starts from."""
