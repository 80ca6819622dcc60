"""`python -m ultramem.training` is `ultramem-train`."""

from ultramem.training.cli import main

if __name__ == "__main__":
    main()
