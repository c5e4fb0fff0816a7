"""mok's benchmarks: tidy CSV rows with provenance under data/bench/ (DESIGN §8). Not part of the library: it
times the library's levels beside their peers and the dense ceiling. Run it as `python -m bench WHAT`."""
