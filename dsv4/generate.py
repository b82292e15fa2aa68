"""`python -m dsv4.generate`: the command line (the functions live in dsv4.generation)."""

from dsv4.generation import main

if __name__ == "__main__":
    main()
