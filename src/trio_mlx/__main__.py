from trio_mlx.cli import main
import sys
sys.exit(main())
