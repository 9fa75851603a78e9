"""What the tests share: real servers (sshd, vLLM, the scripted policy server, the daemon),
fixtures, fault injection, data readers and the drivers run in other venvs. No tests here."""
