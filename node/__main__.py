import sys

from node.entry import main

sys.exit(main())
