import sys

from trio_mlx.cli import main

sys.exit(main())
