"""The verdict the code under test cannot write (docs/security.md): canaries, evidence, runner."""
