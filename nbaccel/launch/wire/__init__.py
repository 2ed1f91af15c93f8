"""What the driver and its ranks share: the messages, the authenticated channel, and how code,
values and exceptions travel between them."""
