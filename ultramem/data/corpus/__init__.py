"""Embedded default training corpus: public-domain Project Gutenberg books (see PROVENANCE.md)."""
