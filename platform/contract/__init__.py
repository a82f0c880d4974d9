"""What the gateway and the workers share: the one package both sides import.

The Redis protocol of a request (`protocol.py`: keys, `RequestInput`, `Usage`). Free of Django and of
every other package of platform/, so a worker process imports it without the control plane.
"""
