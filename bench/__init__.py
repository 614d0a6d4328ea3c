"""Everything around the store that is not the product: support/ (the harness the tests
share), commands/ (the `kvstore` subcommands) and lab/ (the experiments,
`python -m bench.lab NAME`); tests/house_rules.py keeps the three apart."""
