from mtcfs.cli.main import main

main()
