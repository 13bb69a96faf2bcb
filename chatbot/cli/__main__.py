"""`python -m chatbot.cli`: the command line, as the `chatbot` command runs it."""

from chatbot.cli.app import main

main()
