from elastictrain.launch.cli import main

raise SystemExit(main())
