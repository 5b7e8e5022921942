"""`python -m moebench.gate COMPARE_DIR --rules FILE`: the gate without the moebench CLI."""
import sys

from moebench.gate.entry import main

sys.exit(main())
