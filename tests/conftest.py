"""Root of the test tree. Its presence puts tests/ on sys.path (pytest's default "prepend"
import mode adds each conftest's folder), so every test module, sub-folders included,
imports the shared helpers as `from helpers import ...`; no test module imports another."""
