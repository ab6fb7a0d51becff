"""higgs-rt: a lean, fast, embeddable runtime for Higgs-Audio v2 text-to-speech."""

__version__ = "0.1.0"
